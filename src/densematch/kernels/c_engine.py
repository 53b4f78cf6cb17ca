"""Bindings of native.c's engine kernels (:mod:`densematch.kernels.native` holds them all):
l1 / linf distances and their gradients, the passes around l2's product, the tile merge with
its candidate listing, the certified bfloat16 step, and the values of chosen row pairs."""

from __future__ import annotations

import torch

from .loader import _SUFFIX, _loaded, _require, _unit_rows, _unit_stride

__all__ = [
    "GROUP",
    "PAIR_KINDS",
    "Candidates",
    "CertifiedStep",
    "cosine_terms",
    "group_rows",
    "l2_finish",
    "l2_weights",
    "merge",
    "merge_certified",
    "merge_pairs",
    "minkowski",
    "minkowski_grad",
    "pair_values",
    "row_norms",
    "sqnorms",
]

# references per centre where the certified search centres its half rows by groups (DM_GROUP)
GROUP = 32


def minkowski(y: torch.Tensor, x: torch.Tensor, out: torch.Tensor, *, linf: bool, scale: float = 1.0) -> torch.Tensor:
    """``out[f, p] = scale * dist(y[f], x[:, p])``, l1 or linf (``linf``), on this thread.

    Shapes: y (F, D), x (D, P), out (F, P) of any strides; all of one dtype (see :func:`usable`).
    """
    lib = _loaded("minkowski", y, x, out)
    _require(y.dtype in _SUFFIX and y.dtype == x.dtype == out.dtype, "y, x and out: one float dtype")
    y, x = _unit_rows(y), _unit_rows(x)
    f, d = y.shape
    p = x.shape[1]
    if f * p == 0:
        return out
    code = getattr(lib, f"dm_minkowski_{_SUFFIX[y.dtype]}")(
        y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), out.stride(1),
        f, d, p, int(linf), scale,
    )  # fmt: skip
    if code != 0:
        raise MemoryError(f"the l1/linf kernel could not allocate a block of {d} x 16 values")
    return out


def minkowski_grad(
    y: torch.Tensor, x: torch.Tensor, g: torch.Tensor, dist: torch.Tensor, *, linf: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``sum(g * dist)`` with respect to x (D, P) and y (F, D), where ``dist``
    (F, P) is :func:`minkowski`'s output; l1, or linf (the gradient goes to every feature
    where the difference reaches the distance, as torch.cdist's does). On this thread."""
    lib = _loaded("minkowski_grad", y, x, g, dist)
    _require(y.dtype in _SUFFIX and y.dtype == x.dtype == g.dtype == dist.dtype, "y, x, g and dist: one float dtype")
    y, x = _unit_rows(y), _unit_rows(x)
    g, dist = g.contiguous(), dist.contiguous()
    f, d = y.shape
    p = x.shape[1]
    gx = torch.empty((d, p), dtype=x.dtype)
    gy = torch.zeros((f, d), dtype=y.dtype)
    if f * p * d:
        getattr(lib, f"dm_minkowski_grad_{_SUFFIX[y.dtype]}")(
            y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), g.data_ptr(), dist.data_ptr(), p,
            gx.data_ptr(), p, gy.data_ptr(), d, f, d, p, int(linf),
        )  # fmt: skip
    else:
        gx.zero_()
    return gx, gy


def sqnorms(x: torch.Tensor) -> torch.Tensor:
    """The squared norms (P,) of the columns of x (D, P), summed over rows in order; one pass,
    no temporary. On this thread."""
    lib = _loaded("sqnorms", x)
    _require(x.dtype in _SUFFIX and x.dim() == 2, "x must be a 2-D float32 or float64 tensor")
    x = _unit_rows(x)
    d, p = x.shape
    out = torch.empty(p, dtype=x.dtype)
    getattr(lib, f"dm_sqnorms_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.stride(0), out.data_ptr(), d, p)
    return out


def l2_finish(
    t: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, out: torch.Tensor, *, root: bool
) -> torch.Tensor:
    """``out = max(rows[:, None] - 2 t + cols, 0)``, square-rooted if ``root``, in one pass;
    returns each column's smallest value before clamping. Shapes: t (F, P) with unit column
    stride, rows (F,), cols (P,), out (F, P) of any strides; all one dtype; on this thread."""
    lib = _loaded("l2_finish", t, rows, cols, out)
    _require(t.dtype == rows.dtype == cols.dtype == out.dtype, "t, rows, cols and out must share one dtype")
    t, rows, cols = _unit_rows(t), rows.contiguous(), cols.contiguous()
    f, p = t.shape
    colmin = torch.empty(p, dtype=t.dtype)
    getattr(lib, f"dm_l2_finish_{_SUFFIX[t.dtype]}")(
        t.data_ptr(), t.stride(0), rows.data_ptr(), cols.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
        f, p, int(root), colmin.data_ptr(),
    )  # fmt: skip
    return colmin


def l2_weights(
    g: torch.Tensor, dist: torch.Tensor, w: torch.Tensor, *, root: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The l2 backward's pair weights into ``w`` (F, P, contiguous): ``g / dist`` and 0 where
    dist is 0 (``root``), or ``g``; returned with their sums over rows (P,) and over columns
    (F,). g and dist (F, P) may have any strides. On this thread."""
    lib = _loaded("l2_weights", g, dist, w)
    _require(g.dtype == dist.dtype == w.dtype and w.is_contiguous(), "g, dist and w must share one dtype, w contiguous")
    f, p = g.shape
    colsum = torch.empty(p, dtype=g.dtype)
    rowsum = torch.empty(f, dtype=g.dtype)
    getattr(lib, f"dm_l2_weights_{_SUFFIX[g.dtype]}")(
        g.data_ptr(), g.stride(0), g.stride(1), dist.data_ptr(), dist.stride(0), dist.stride(1),
        w.data_ptr(), colsum.data_ptr(), rowsum.data_ptr(), f, p, int(root),
    )  # fmt: skip
    return w, colsum, rowsum


class Candidates:
    """Per-row candidate slots for :func:`merge`'s certified listing: ``cols`` (m, cap) int64,
    ``vals`` (m, cap), ``counts`` (m,) int32, ``over`` (m,) bool (rows that had more than cap)."""

    def __init__(self, m: int, cap: int, dtype: torch.dtype) -> None:
        self.cap = cap
        self.cols = torch.empty((m, cap), dtype=torch.int64)
        self.vals = torch.empty((m, cap), dtype=dtype)
        self.counts = torch.zeros(m, dtype=torch.int32)
        self.over = torch.zeros(m, dtype=torch.bool)

    def take(self, rows: torch.Tensor) -> Candidates:
        """The slots of ``rows`` (int64) as a list of their own, for a search of those rows only."""
        part = Candidates(0, self.cap, self.vals.dtype)
        part.cols, part.vals = self.cols[rows], self.vals[rows]
        part.counts, part.over = self.counts[rows], self.over[rows]
        return part

    def put(self, rows: torch.Tensor, part: Candidates) -> None:
        """Write the list ``part``, taken for ``rows``, back into these slots."""
        self.cols[rows], self.vals[rows] = part.cols, part.vals
        self.counts[rows], self.over[rows] = part.counts, part.over

    def reaching(self, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) of the listed pairs scoring at least their row's ``floor``, rows that
        are over left out."""
        lib = _loaded("Candidates.reaching", floor, self.cols, self.vals, self.counts, self.over)
        m = self.counts.shape[0]
        _require(floor.shape == (m,) and floor.dtype == self.vals.dtype, "floor must be (rows,) in the lists' dtype")
        lists = (self.cols, self.vals, self.counts, self.over)
        _require(all(t.is_contiguous() for t in lists), "the lists must be contiguous")
        room = int(self.counts.sum())
        rows, cols = torch.empty(room, dtype=torch.int64), torch.empty(room, dtype=torch.int64)
        if room == 0:
            return rows, cols
        floor = floor.contiguous()
        found = getattr(lib, f"dm_list_reaching_{_SUFFIX[self.vals.dtype]}")(
            self.cols.data_ptr(), self.vals.data_ptr(), self.counts.data_ptr(), self.over.data_ptr(),
            m, self.cap, floor.data_ptr(), rows.data_ptr(), cols.data_ptr(),
        )  # fmt: skip
        return rows[:found], cols[:found]


def merge(
    s: torch.Tensor,
    offset: int,
    best_v: torch.Tensor,
    best_i: torch.Tensor,
    margin: torch.Tensor | None = None,
    listed: Candidates | None = None,
    *,
    bias: torch.Tensor | None = None,
) -> None:
    """Merge the score tile ``s`` (m, n; columns ``offset`` onwards; higher is better) into the
    running top-k ``best_v`` / ``best_i`` (m, k, contiguous; best first, -inf / -1 when empty),
    equal scores to the lower column. With ``margin`` (m,) and ``listed``, also list every pair
    reaching its row's k-th best minus the margin, with its score plus the margin, and keep a
    full list's pairs whose value reaches the k-th best (native_t.h). bfloat16 scores merge into a
    float32 top-k, without a margin, each column plus ``bias`` (n,) in float32 where given. On
    this thread."""
    lib = _loaded("merge", s, best_v, best_i, margin, bias)
    _require(best_v.is_contiguous() and best_i.is_contiguous(), "the running top-k must be contiguous")
    if s.dtype == torch.bfloat16:
        _require(best_v.dtype == torch.float32 and margin is None, "bfloat16 scores merge into float32, no margin")
        s = _unit_rows(s)
        if bias is not None:
            bias = bias.float().contiguous()
        if s.numel():
            lib.dm_merge_bf16(
                s.data_ptr(), s.stride(0), *s.shape, offset, best_v.data_ptr(), best_i.data_ptr(), best_v.shape[1],
                None if bias is None else bias.data_ptr(),
            )  # fmt: skip
        return
    _require(bias is None, "only bfloat16 scores take a bias")
    _require(s.dtype == best_v.dtype, "the scores and the running top-k must share one dtype")
    s = _unit_rows(s)
    m, n = s.shape
    if m * n == 0:
        return
    null = None
    if margin is not None:
        _require(
            listed is not None and margin.dtype == s.dtype, "a margin needs a candidate list and the scores' dtype"
        )
        margin = margin.contiguous()
    getattr(lib, f"dm_merge_{_SUFFIX[s.dtype]}")(
        s.data_ptr(), s.stride(0), m, n, offset, best_v.data_ptr(), best_i.data_ptr(), best_v.shape[1],
        null if margin is None else margin.data_ptr(),
        0 if listed is None else listed.cap,
        null if listed is None else listed.cols.data_ptr(),
        null if listed is None else listed.vals.data_ptr(),
        null if listed is None else listed.counts.data_ptr(),
        null if listed is None else listed.over.data_ptr(),
    )  # fmt: skip


def merge_pairs(
    rows: torch.Tensor, cols: torch.Tensor, score: torch.Tensor, best_v: torch.Tensor, best_i: torch.Tensor
) -> None:
    """Merge the scored pairs (``rows[t]``, ``cols[t]``, ``score[t]``; 1-D, rows and cols int64,
    in any order) into the running top-k ``best_v`` / ``best_i`` (m, k, contiguous; best first,
    -inf / -1 when empty) of their rows, equal scores to the lower column; a NaN score never
    enters. Rows must lie in [0, m). On this thread."""
    lib = _loaded("merge_pairs", rows, cols, score, best_v, best_i)
    _require(best_v.is_contiguous() and best_i.is_contiguous(), "the running top-k must be contiguous")
    _require(score.dtype == best_v.dtype and best_i.dtype == torch.int64, "score must be in the top-k's dtype")
    _require(rows.dtype == cols.dtype == torch.int64, "rows and cols must be int64")
    _require(rows.numel() == cols.numel() == score.numel(), "rows, cols and score must have one length each")
    if rows.numel() == 0:
        return
    _require(0 <= int(rows.min()) and int(rows.max()) < best_v.shape[0], "rows must index best_v's rows")
    rows, cols, score = rows.contiguous(), cols.contiguous(), score.contiguous()
    getattr(lib, f"dm_merge_pairs_{_SUFFIX[score.dtype]}")(
        rows.data_ptr(), cols.data_ptr(), score.data_ptr(), rows.numel(),
        best_v.data_ptr(), best_i.data_ptr(), best_v.shape[1],
    )  # fmt: skip


class CertifiedStep:
    """The certified search's step (native.c's ``dm_merge_certified_bf16``) for one query tile's
    rows, called once per reference tile. What holds for every tile is checked and held here once:
    the running top-k ``best_v`` / ``best_i`` (m, k, float32 / int64, contiguous; lower bounds
    merged, equal values to the lower column), the rows' bound terms ``qt`` (m, 3,
    :func:`densematch.precision.query_terms`), the ``listed`` candidates (upper bounds reaching
    each row's k-th lower bound), the ``rounding`` of the stored scores and, where the references'
    half rows were centred per group of :data:`GROUP`, the rows' group terms ``group_terms``
    (m, 5, :func:`densematch.precision.group_terms`). A tile's call then costs the C step and
    a few checks: a third of what one call's checks and copies cost when each tile made them
    all (about a quarter of a late tile's step on an AVX2 CPU; BENCHMARKS.md)."""

    def __init__(
        self,
        best_v: torch.Tensor,
        best_i: torch.Tensor,
        qt: torch.Tensor,
        rounding: float,
        listed: Candidates,
        group_terms: torch.Tensor | None = None,
    ) -> None:
        self._lib = _loaded("CertifiedStep", best_v, best_i, qt, group_terms)
        _require(best_v.dtype == torch.float32 and best_i.dtype == torch.int64, "best_v must be float32, best_i int64")
        _require(best_v.is_contiguous() and best_i.is_contiguous(), "the running top-k must be contiguous")
        m = best_v.shape[0]
        _require(qt.shape == (m, 3), "qt must be the rows' terms (rows, 3)")
        lists = (listed.cols, listed.vals, listed.counts, listed.over)
        _require(all(t.is_contiguous() and t.shape[0] == m for t in lists), "the lists must be contiguous, a row each")
        self.qt = qt.float().contiguous()
        self.gq = None
        if group_terms is not None:
            _require(group_terms.shape == (m, 5) and group_terms.dtype == torch.float32, "group_terms: (rows, 5)")
            self.gq = group_terms.contiguous()
        self.rows, self.listed, self._held = m, listed, (best_v, best_i)  # (held: their pointers below)
        self._tail = (
            rounding, best_v.data_ptr(), best_i.data_ptr(), best_v.shape[1],
            listed.cap, *(t.data_ptr() for t in lists),
        )  # fmt: skip
        self._zeros = torch.zeros(0)
        self._scratch = torch.empty(0)

    def __call__(
        self,
        h: torch.Tensor,
        offset: int,
        planes: torch.Tensor,
        bias: torch.Tensor | None = None,
        groups: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> int:
        """The step for the bfloat16 score tile ``h`` (m, n; unit-stride rows; columns
        ``offset`` onwards) with the references' bound terms ``planes`` (3, n, float32,
        :func:`densematch.precision.ref_terms` as planes: unit-stride rows, any row stride),
        ``bias`` (n,) float32 or None and, with group terms, ``groups``: each row's float32
        product with the centres of the groups this tile touches (m, g; unit-stride rows, the
        first being group ``offset // GROUP``) and those groups' terms (g, 3,
        :func:`densematch.precision.group_norms`). Returns how many of the rows are over the
        cap (``listed.over``), this tile's and earlier."""
        _loaded("CertifiedStep", h, planes, bias, groups)
        m, n = h.shape
        _require(h.dtype == torch.bfloat16 and m == self.rows and _unit_stride(h), "h must be bfloat16 (rows, n)")
        _require(
            planes.dtype == torch.float32 and planes.shape == (3, n) and _unit_stride(planes),
            "planes must be the references' terms (3, n), float32, unit-stride rows",
        )
        if m * n == 0:
            return int(self.listed.over.sum())
        _require(bias is None or (bias.dtype == torch.float32 and bias.shape == (n,)), "bias must be (n,) float32")
        if bias is None:
            if self._zeros.numel() < n:
                self._zeros = torch.zeros(n)
            bias = self._zeros
        elif bias.stride(0) != 1:  # (the l2 column of prepared rows, where not centred)
            bias = bias.contiguous()
        gp = gt = None
        if (groups is None) != (self.gq is None):
            raise ValueError("groups go with the group terms the step was made with")
        if groups is not None:
            gp, gt = groups
            touched = (offset + n - 1) // GROUP - offset // GROUP + 1
            _require(
                gp.shape[0] == m and gp.shape[1] >= touched and gt.shape[0] >= touched and gt.shape[1] == 3,
                "groups must be the products (rows, groups touched) and the groups' terms (groups, 3)",
            )
            _require(gp.dtype == gt.dtype == torch.float32, "groups must be float32")
            _require(_unit_stride(gp) and gt.is_contiguous(), "the groups' products need unit-stride rows")
        size = 10 * (n // GROUP + 1)  # the C step's chunk test and seeded floor (native.c)
        if self._scratch.numel() < size:
            self._scratch = torch.empty(size)
        gone = self._lib.dm_merge_certified_bf16(
            h.data_ptr(), h.stride(0), m, n, offset, bias.data_ptr(),
            None if gp is None else gp.data_ptr(), 0 if gp is None else gp.stride(0),
            None if self.gq is None else self.gq.data_ptr(), None if gt is None else gt.data_ptr(),
            self.qt.data_ptr(), planes.data_ptr(), planes.stride(0), *self._tail, self._scratch.data_ptr(),
        )  # fmt: skip
        return int(gone)


def merge_certified(
    h: torch.Tensor,
    offset: int,
    best_v: torch.Tensor,
    best_i: torch.Tensor,
    qt: torch.Tensor,
    rt: torch.Tensor,
    bias: torch.Tensor | None,
    rounding: float,
    listed: Candidates,
    groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> int:
    """One :class:`CertifiedStep` call: the step for the bfloat16 score tile ``h`` (m, n;
    columns ``offset`` onwards) with the references' terms ``rt`` as rows (n, 3) and
    ``groups`` as ``(products, query_terms, group_terms)``. Returns how many of the rows are
    over the cap."""
    _require(h.dtype == torch.bfloat16, "h must be bfloat16")
    gq, pair = (None, None) if groups is None else (groups[1], (groups[0], groups[2].contiguous()))
    step = CertifiedStep(best_v, best_i, qt, rounding, listed, gq)
    planes = rt.float().T.contiguous()
    return step(_unit_rows(h), offset, planes, None if bias is None else bias.float().contiguous(), pair)


def row_norms(x: torch.Tensor, h: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's norms (n, 4): ``|x|``, ``|h|``, ``|h - x|`` and ``|u|`` (0 without ``u``), of x
    and u (n, C) float32 and h (n, C) bfloat16, each with unit-stride rows; in one pass, summed in
    float64 (native.c), for :func:`densematch.precision.query_terms`, ``ref_terms`` and
    ``group_terms``. On this thread."""
    lib = _loaded("row_norms", x, h, u)
    _require(x.dtype == torch.float32 and h.dtype == torch.bfloat16, "x must be float32, h bfloat16")
    _require(x.dim() == 2 and h.shape == x.shape, "x and h must be (n, C) of one shape")
    _require(u is None or (u.shape == x.shape and u.dtype == torch.float32), "u must be float32 of x's shape")
    x, h = _unit_rows(x), _unit_rows(h)
    u = None if u is None else _unit_rows(u)
    out = torch.empty((x.shape[0], 4), dtype=torch.float32)
    lib.dm_row_norms_bf16(
        x.data_ptr(), x.stride(0), h.data_ptr(), h.stride(0), None if u is None else u.data_ptr(),
        0 if u is None else u.stride(0), x.shape[0], x.shape[1], out.data_ptr(),
    )  # fmt: skip
    return out


def group_rows(r: torch.Tensor, c: int, halves: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The certified search's reference groups of :data:`GROUP` rows of ``r`` (n, C + extra)
    float32 in one pass: their centres (G, c) (each group's mean of its first ``c`` columns), the
    rows less their group's centre (the extra columns as they are) written to ``halves`` (n, C +
    extra) in bfloat16, and the norms (n, 4) ``|d|``, ``|h|``, ``|h - d|``, ``|b|`` of the body
    columns ``b``, ``d = b - t`` and its half copy ``h``, as :func:`row_norms` makes them of
    ``(d, h, b)``. None where a centre or a norm is not finite (torch's form handles such rows).
    On this thread."""
    lib = _loaded("group_rows", r, halves)
    _require(r.dtype == torch.float32 and halves.dtype == torch.bfloat16, "r must be float32, halves bfloat16")
    _require(r.dim() == 2 and halves.shape == r.shape and 0 <= c <= r.shape[1], "r and halves: (n, C) of one shape")
    r = _unit_rows(r)
    _require(_unit_stride(halves), "halves must have unit-stride rows")
    n = r.shape[0]
    centres = torch.empty((-(-n // GROUP), c), dtype=torch.float32)
    norms = torch.empty((n, 4), dtype=torch.float32)
    code = lib.dm_group_bf16(
        r.data_ptr(), r.stride(0), n, c, r.shape[1] - c, GROUP, centres.data_ptr(), halves.data_ptr(),
        halves.stride(0), norms.data_ptr(),
    )  # fmt: skip
    if code == 2:
        raise MemoryError(f"the grouping kernel could not allocate a row of {c} values")
    return None if code else (centres, norms)


PAIR_KINDS = {"dot": 0, "sqdiff": 1, "absdiff": 2, "maxabs": 3, "cosine": 4}


def cosine_terms(x: torch.Tensor) -> torch.Tensor:
    """Each row's cosine terms (n, 3) for :func:`pair_values`, of x (n, C) float32 or float64 with
    unit-stride rows: the row's scale, two powers of two that bring its largest magnitude to
    [0.5, 1), and its norm after them; (0, 0, 0) for a zero row, (0, 0, NaN) for a row holding
    a NaN. On this thread."""
    lib = _loaded("cosine_terms", x)
    _require(x.dim() == 2 and _unit_stride(x), "x must be (n, C) with unit-stride rows")
    out = torch.empty((x.shape[0], 3), dtype=x.dtype)
    if x.shape[0]:
        getattr(lib, f"dm_cosine_terms_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.stride(0), *x.shape, out.data_ptr())
    return out


def pair_values(
    q: torch.Tensor,
    r: torch.Tensor,
    idx: torch.Tensor,
    kind: str,
    *,
    q_rows: torch.Tensor | None = None,
    r_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Values (m, k) of the row pairs (q[q_rows[i]], r[idx[i, j]]) (q[i] without ``q_rows``):
    "dot", "sqdiff" (sum of squared differences), "absdiff", "maxabs" or "cosine". q (mq, C)
    and r (n, C) of one dtype, any strides (rows that are not unit-stride are gathered first);
    idx (m, k) and q_rows (m,) int64. Each pair is reduced in one order, so equal rows give
    equal values. For "cosine", ``r_terms`` (:func:`cosine_terms` of r, unit-stride rows) spare
    each pair the reference's scale and norm: the same values to the bit, faster (a query row's
    are computed once for its consecutive pairs). On this thread."""
    lib = _loaded("pair_values", q, r, idx, q_rows, r_terms)
    _require(q.dtype == r.dtype and idx.dtype == torch.int64, "q and r must share one dtype, idx be int64")
    m, k = idx.shape
    out = torch.empty((m, k), dtype=q.dtype)
    if m * k == 0:
        return out
    if r_terms is not None:
        _require(kind == "cosine" and _unit_stride(r), "r_terms go with cosine of unit-stride references")
        _require(
            r_terms.shape == (r.shape[0], 3) and r_terms.dtype == r.dtype,
            "r_terms must be (rows of r, 3) in r's dtype",
        )
        r_terms = r_terms.contiguous()
    # rows that are not unit-stride are gathered: one copy beats a cache line per value
    if not _unit_stride(q):
        q, q_rows = q.index_select(0, q_rows) if q_rows is not None else q.contiguous(), None
    ridx: torch.Tensor | None = idx.contiguous()
    if not _unit_stride(r):
        r, ridx = r.index_select(0, idx.reshape(-1)), None
    if q_rows is not None:
        q_rows = q_rows.contiguous()
    getattr(lib, f"dm_pair_values_{_SUFFIX[q.dtype]}")(
        q.data_ptr(), q.stride(0), None if q_rows is None else q_rows.data_ptr(),
        r.data_ptr(), r.stride(0), None if ridx is None else ridx.data_ptr(),
        m, k, q.shape[1], PAIR_KINDS[kind], None if r_terms is None else r_terms.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return out
